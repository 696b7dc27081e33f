"""Retrieval: corpora and chunking (corpus), the BM25 + optional dense index (index, embed),
the POST /search wire types (wire) and the `search` Serve deployment (deployment)."""
