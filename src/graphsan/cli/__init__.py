"""`graphsan` on the command line: the console entry point and its commands (main.py: the top
parser; run.py, report.py, selftest.py: one command each; options.py: what several share), and
the pytest plugin (pytest_plugin.py: `pytest --graphsan`). Nothing here loads torch until a
command that needs it runs."""
