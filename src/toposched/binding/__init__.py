"""Launch plans: what real engines, Kubernetes and Ray take to run a placement."""
