"""Developer/test setup helpers: a real CPU vLLM install and tiny seeded models.

Nothing here is imported by the runtime itself; tests and the dev loop call it.
"""
