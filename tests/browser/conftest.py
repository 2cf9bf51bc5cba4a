# The explorers notebook is what `make test-browser` opens in JupyterLab; the unit tests of the
# explorers are tests/test_explore.py, so `make test` does not run it a second time under nbval.
collect_ignore = ["explorers.ipynb"]
