"""What makes a state trustworthy: checksums, signatures, the canonical digest, bounded
unpickling under one allowlist, and files verified where they lie without following links."""
