"""Records: what a record, a round, an outcome, a statistic may be; pure, no I/O."""
