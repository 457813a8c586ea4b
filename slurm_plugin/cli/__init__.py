"""The ``straggler`` command line: the only package that imports click."""
