"""What the tests share besides fixtures: plain functions, classes and constants, imported one way
(`from tests.helpers.<module> import ...`; pyproject's `pythonpath` puts the repository root on sys.path).
Fixtures stay in the conftest.py files; a test module never imports another test module or a conftest."""
