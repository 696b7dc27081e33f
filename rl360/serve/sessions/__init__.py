"""Agent sessions: the OpenAI-compatible HTTP server, the shard actors that hold ledgers, the
session service and the token ledger (TITO)."""
