"""TRL's own unit tests run against ``hflight.trl`` (issue 47, item 5): ``python -m tests.trl_upstream --trl-tests
<TRL checkout>/tests --out <folder> [test files]`` builds local stand-ins for the hub repositories the tests load
(:mod:`.standins`), runs the selected test files as they are (TRL on transformers) and with the one import changed
(:mod:`.compare`), offline, with :mod:`.plugin` serving the data sets and a per-test time limit, and writes a table of
outcomes per test, listing those that pass with TRL and fail with hflight.trl. TRL's tests are not in its wheel and are
never copied into this project; a support package of the tests, not collected by pytest."""
