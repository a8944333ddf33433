"""NATS plumbing shared by the indexer, the relay and the producer: the asyncio thread a blocking
caller drives NATS through (natsio) and the JetStream event publisher (jetstream_publisher)."""
