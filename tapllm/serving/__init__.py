"""tapllm across machines: a Ray Serve deployment (``tapllm.serving.ray``) of data-parallel engine replicas.

Only ``tapllm.serving.ray`` needs Ray (``pip install 'tapllm[ray]'``); the ASGI driver, the
options and the routing tokens are plain Python.
"""
