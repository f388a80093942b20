"""The evidence behind every number the docs quote, by concern (tools/evidence.py is the command):

- registry: every result file, its command, what code it measures, its headline; the published and
  derived figures the docs cite by name;
- staleness: whether a result's code changed since it ran;
- tables: the generated index (docs/results/README.md) and README's results table;
- numbers: the key-path language, the docs' numbers checked against their files, the directive
  tables rendered from them.
"""
