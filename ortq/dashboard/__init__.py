"""``ortq dashboard``: rq-dashboard with ortq's serializer, plus an ortq page."""
