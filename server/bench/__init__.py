"""The benchmarks and load tools of the `kvserve bench*` and `kvserve soak` commands: in process against the
engine (offline.py, spec.py), or over HTTP against any OpenAI-compatible server (http.py, soak.py), on the same
workloads (workloads.py)."""
