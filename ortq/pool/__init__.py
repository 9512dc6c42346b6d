"""``ortq pool``: N worker processes per adapter from one config file."""
