"""userdp on Kubernetes: the chart values a config becomes, the Secrets the chart mounts, and
the health probe its pods run (``userdp deploy``)."""
