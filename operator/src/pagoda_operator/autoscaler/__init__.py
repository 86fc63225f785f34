"""Pagoda's autoscaler: Prometheus metrics in, replicas out.

`decision` (pure: the rules), `prometheus` (the HTTP API client and the PromQL of each policy),
`handlers` (the kopf timer that runs one decision per InferenceService and applies it through the
scale subresource), `scaledobjects` (KEDA ScaledObject / HPA manifests for driver keda | hpa).
"""
