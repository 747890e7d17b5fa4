"""Maintenance: gc, compaction, verification, export and plotting. Each goes through the log's
own calls and the writer, and is safe to run while writers and readers are live."""
