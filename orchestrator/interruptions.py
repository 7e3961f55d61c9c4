"""The interruptions a drill (``--how``) and a storm (``--storm``) cause, and how each is classified.

=============  ======================================  ===================  ===========================  ======
kind           what strikes                            classified           budget the drill raises      drill
=============  ======================================  ===================  ===========================  ======
crash          a rank exits (``os._exit``) at the     application          ``failure.max_failures``     yes
               point
sigterm        a rank gets a preemption notice, saves  preemption           ``failure.max_preemptions``  yes
               at the next boundary, then dies
save-crash     a rank exits in a phase of the first    application          ``failure.max_failures``     no
               save at or after the point
node           the node of a rank is lost              preemption           ``failure.max_preemptions``  yes
node-gone      as ``node``, never replaced (elastic:   preemption           ``failure.max_preemptions``  no
               fewer workers from here; last, once)
two-nodes      the nodes of two ranks are lost at      preemption           ``failure.max_preemptions``  no
               once
crash+node     a crash, then the same rank's node is   application, then    both                         no
               lost as the next attempt starts         preemption
=============  ======================================  ===================  ===========================  ======

A ``StrEnum``: each kind equals its text, so the CLI's ``--how`` values, the plan table and the
report read exactly as the strings they replace.
"""

from __future__ import annotations

from enum import StrEnum


class InterruptionKind(StrEnum):
    """One interruption a drill or a storm causes; the module docstring's table says what each
    strikes, how the attempt's failure is classified and which budget it spends."""

    CRASH = "crash"
    SIGTERM = "sigterm"
    SAVE_CRASH = "save-crash"
    NODE = "node"
    NODE_GONE = "node-gone"
    TWO_NODES = "two-nodes"
    CRASH_THEN_NODE = "crash+node"


# the kinds that lose a node (the storm's controller thread removes it)
NODE_KINDS = (
    InterruptionKind.NODE,
    InterruptionKind.NODE_GONE,
    InterruptionKind.TWO_NODES,
    InterruptionKind.CRASH_THEN_NODE,
)
# what ``syncpoint drill --how`` takes
DRILL_KINDS = (InterruptionKind.CRASH, InterruptionKind.SIGTERM, InterruptionKind.NODE)
