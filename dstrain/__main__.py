from dstrain.main import cli

cli()
