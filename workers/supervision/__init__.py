"""Process supervision and recovery: how ranks are started (launch, fork servers, the node's warm
server), supervised and recovered in place, and the notices, heartbeats and faults that drive it."""
