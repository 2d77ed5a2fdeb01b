"""spec-serve: the OpenAI Batch API (Files, Batches, Models) over the fleet's Redis.

Submit side: it imports jobstore and producer, never the engine, the worker or MLX, so
it installs with the base package. `server.app.create_app` is the ASGI application,
`server.cli.serve` the command.
"""
