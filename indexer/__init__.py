"""Router side: ZMQ ingestion, gap handling, the global index, scoring, snapshots, event logs.

Import-light: never imports torch; import submodules explicitly (e.g. `indexer.subscriber`).
"""
