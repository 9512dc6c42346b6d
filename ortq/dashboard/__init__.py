"""``ortq dashboard``: an ortq page plus rq-dashboard, pickle-free, escaped, CSRF-checked, with an
optional login (docs/operations.md, "Dashboard")."""
