"""The probes: evidence that needs extra work beyond watching. Mutation replays (does a replay keep
changing a static input?), padded-row and padded-column fills (``diagnose``), differential replay
(does the replay give what an eager run of the same step gives?) and launch-trace comparison."""
