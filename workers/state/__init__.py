"""State I/O: the writer (every rank's files, then the manifest last), the reader (verify every
byte, then load), saving at boundaries, discovery of candidates, and where an attempt resumes."""
