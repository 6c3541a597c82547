"""
The chat server as a library: app.py (the FastAPI app and its routes), workers.py (model replicas and the pools that
hand them requests), scheduler.py (continuous batching: one decode batch across requests, also used by chat_eval and
chat_rl through generate_many), kv_slots.py (its KV slots, prefix cache and memory plan), invariance.py (when a
request's bits do not depend on its neighbours: the BLAS's mode and sizes), generation.py (tokens from the
generating thread to the event loop as text), schema.py (what a request may hold) and ui.html (the chat page).
scripts/chat_web.py is its command line; bench/infer_bench.py and bench/serve_bench.py serve the same app.
"""
