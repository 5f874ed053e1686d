"""Helpers of the public front doors that are not themselves public: the CLI's argument
parser (``cli_parser``) and the pytest plugin's machinery (``pytest_support``)."""
