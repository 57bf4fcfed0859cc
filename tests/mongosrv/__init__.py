"""The MongoDB stand-in behind tests/mongo_server.py (its entry point and documentation), one
module per role: see the module list at the end of mongo_server.py's docstring."""
