"""Pagoda's Kubernetes operator: the InferenceService resource and what it becomes.

Modules, one concern each: `spec` (the resource, defined once), `crd` (its CRD, generated),
`models` (known model architectures), `validation` (spec checks with the arithmetic shown),
`render` (spec → child manifests, pure), `conditions` (status computed from children, pure),
`kube` (the few API calls the operator makes), `handlers` (kopf wiring), `cli`.
"""

__version__ = "0.1.0"
