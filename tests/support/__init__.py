"""Helpers only the tests use (fault injection, a throwaway TLS CA, a Redis Cluster),
kept out of the installed package. The tests import them as `support.*`: pytest puts
tests/ on sys.path, since tests/ holds conftest.py and is not a package."""
