"""
The chat server as a library: app.py (the FastAPI app and its routes), workers.py (model replicas and the pool that
hands them to requests), generation.py (a generation thread's tokens to the event loop as text), schema.py (what a
request may hold) and ui.html (the chat page). scripts/chat_web.py is its command line; bench/infer_bench.py serves
the same app in process.
"""
