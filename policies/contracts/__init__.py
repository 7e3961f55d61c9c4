"""The contracts: the job spec models, the state format and the names a manifest may give, the
event log typed events and its reader, every error the project raises, and how user code and
stored JSON are read. Data definitions, no I/O, no Ray."""
