"""`ft serve`'s HTTP side: FastAPI app, engine thread, OpenAI and admin routes, metrics."""
