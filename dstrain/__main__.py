import sys

from dstrain.main import main

sys.exit(main())
