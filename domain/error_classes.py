"""The error-class table: one row per class of failure, and everything said about it comes from here.

Each `ErrorClass` row holds how a failure of that class is retried (`retried`, read by
`domain/policy/retry.py` `retry_decision`), the event that ends the job when it is not retried or
runs out of attempts (`terminal_event`), whether the source file can cause it (`from_the_file`,
read by the diagnosis' history rules), what it is (`meaning`: the glossary's line,
`projections/glossary.py`), what a retry would do (`on_retry`: the words the exceptions' messages,
the diagnosis' "why" and the glossary use), whether the diagnosis calls a job that ended with it
permanent (`permanent`) and what to do about it (`what_to_do`: the diagnosis' action), or which
cause to fix before a replay (`cause`). `AttemptFailed.retryable` is `ErrorClass.retryable`.

The tables in `docs/design.md` ("Error classes") and `docs/operating.md` ("Error classes") are
`markdown()`, written between their markers by `python -m projections.doc_tables --write` and
compared with it by `tests/unit/test_error_classes.py`. Pure; standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

NOT_RETRIED = "no"
BACKOFF = "backoff"  # the retry policy's schedule (60 s, 300 s, 900 s by default, +-10 % jitter)
COOLDOWN = "cooldown"  # the provider's Retry-After, else the policy's schedule
AT_ONCE = "at_once"  # a stall: retried without a wait
AT_ONCE_FREE = "at_once_free"  # retried at once and the attempt is given back (never uses the budget)

RETRIED_WORDS: dict[str, str] = {
    NOT_RETRIED: "no",
    BACKOFF: "yes, after the policy's backoff (60 s, 300 s, 900 s by default, +-10 % jitter)",
    COOLDOWN: "yes, after the provider's `Retry-After`, else the policy's backoff",
    AT_ONCE: "yes, at once",
    AT_ONCE_FREE: "yes, at once, in the region that took over; the attempt is given back",
}
"""How each kind of `retried` reads in the docs' tables."""


@dataclass(frozen=True)
class ErrorClass:
    """One error class. `name`: as events record it (`AttemptFailed.error_class`); `retried`: one of
    `NOT_RETRIED`, `BACKOFF`, `COOLDOWN`, `AT_ONCE`, `AT_ONCE_FREE`; `terminal_event`: the event
    that ends the job when it is not retried (or attempts run out); `from_the_file`: the source file
    can cause it (a repeat after a replay, or in another job of the same file, points at the file);
    `meaning`: what happened, in an operator's words; `on_retry`: what a retry would do ("a retry
    would ...", "a retry may pass ..."); `permanent`: a job that ended with it will fail the same way
    again if replayed as it is; `what_to_do`: the diagnosis' action when a job ended with it
    (`{job}` and `{letter}` are filled in: the job id and the dead letter id `job/attempt`;
    `{still}` is the diagnosis' note when the job failed the same way after a replay); `cause`:
    what to fix before a replay."""

    name: str
    retried: str
    terminal_event: str
    from_the_file: bool
    meaning: str
    on_retry: str
    permanent: bool
    what_to_do: str
    cause: str = ""

    @property
    def retryable(self) -> bool:
        """True when a failure of this class is retried (`AttemptFailed.retryable`)."""
        return self.retried != NOT_RETRIED

    @property
    def ends_with(self) -> str:
        """The docs' "ends the job with" cell."""
        if self.retried == AT_ONCE_FREE:
            return f"never by itself: it uses no attempt (`{self.terminal_event}` only if the budget is spent otherwise)"
        if not self.retryable and self.terminal_event == "JobDeadLettered":
            return "`JobDeadLettered` at once (an operator deals with it, then replays or fails it)"
        if not self.retryable:
            return f"`{self.terminal_event}`"
        return f"`{self.terminal_event}` when out of attempts"


def fixable(name: str, retried: str, terminal_event: str, from_the_file: bool, meaning: str, on_retry: str,
            cause: str) -> ErrorClass:
    """A class a replay may pass once `cause` is fixed: not permanent, and what to do is `_fix(cause)`."""
    return ErrorClass(name, retried, terminal_event, from_the_file, meaning, on_retry, False, _fix(cause), cause)


def _fix(cause: str) -> str:
    """The "what to do" of a retryable class: fix `cause`, then replay (`{still}`: a note the
    diagnosis adds when it failed the same way after a replay)."""
    return f'Fix {cause}{{still}}, then replay: `tapeline dlq replay {{letter}} --why "..."`.'


_INPUT = "Do not replay: ask the submitter for a corrected file."
_SAME_INPUT = "a retry would fail the same way: the same input fails the same way every time"

ERROR_CLASSES: dict[str, ErrorClass] = {c.name: c for c in (
    ErrorClass("invalid_input", NOT_RETRIED, "JobFailed", True,
               "the source is not valid media or breaks a rule of the request", _SAME_INPUT, True, _INPUT),
    ErrorClass("unsupported_media", NOT_RETRIED, "JobFailed", True,
               "the media is valid but Tapeline cannot process it, or a check fails the same way every time",
               _SAME_INPUT, True, _INPUT),
    ErrorClass("limits_exceeded", NOT_RETRIED, "JobFailed", True,
               "the source is past a size, duration or resolution limit", _SAME_INPUT, True, _INPUT),
    ErrorClass("quota_exceeded", NOT_RETRIED, "JobRejected", False,
               "the submitter's own quota was used up at intake",
               "a retry would be refused the same way until the submitter's quota allows it", True,
               "Nothing to do: resubmit once the submitter's quota allows it."),
    fixable("provider_throttled", COOLDOWN, "JobDeadLettered", False,
            "the publish provider answered 429 or 5xx, or did not answer",
            "a retry may pass once the provider answers again", "the publish provider"),
    fixable("storage_transient", BACKOFF, "JobDeadLettered", False, "the object store failed for a while",
            "a retry may pass once the object store works again", "the object store"),
    # A published key holds other bytes (another deployment's job, or a stale object in a shared
    # bucket): a retry writes to the same key and meets the same object, so it goes to an operator
    # at once, reopenable once the object is dealt with.
    ErrorClass("output_conflict", NOT_RETRIED, "JobDeadLettered", False,
               "a key the job writes once already holds other bytes (another job or deployment wrote it)",
               "a retry would meet the same object again until it is removed", True,
               "Either remove the object in the way (if nothing should be serving it), then replay: "
               '`tapeline dlq replay {letter} --why "..."`; or end the job and refund the submitter: '
               '`tapeline dlq fail {letter} --refund --why "..."`.', "the object in the way"),
    fixable("broker_transient", BACKOFF, "JobDeadLettered", False, "Kafka failed for a while",
            "a retry may pass once Kafka works again", "Kafka"),
    fixable("timeout", BACKOFF, "JobDeadLettered", True, "the work ran past its time limit",
            "a retry may pass on a less loaded worker",
            "what made the work slow (load, or a time limit too short for the source)"),
    fixable("out_of_memory", BACKOFF, "JobDeadLettered", True, "the work ran out of memory",
            "a retry may pass on a worker with more memory free", "the memory limit"),
    fixable("worker_lost", AT_ONCE, "JobDeadLettered", True,
            "the worker was lost: it stopped heartbeating or its process exited",
            "a retry may pass on another worker", "the workers (their hosts, their logs)"),
    fixable("progress_stalled", AT_ONCE, "JobDeadLettered", True,
            "the worker was alive but its ffmpeg stopped advancing (a no-progress stall)",
            "a retry may pass unless the source itself freezes ffmpeg",
            "what froze ffmpeg (the source, or the worker's host)"),
    # An attempt lost with its region (a failover): retried at once in the region that took over,
    # and its attempt is given back (domain/lifecycle.py FREE_STALL_KINDS).
    fixable("region_lost", AT_ONCE_FREE, "JobDeadLettered", False,
            "the attempt's region was lost and another took over",
            "a retry may pass in the region that took over", "the region the job runs in"),
    fixable("unknown", BACKOFF, "JobDeadLettered", True, "an error not classified",
            "a retry may pass: the error is not classified", "the error shown in the timeline"),
)}
"""Every error class by name. An unknown name counts as `unknown` (`error_class`)."""


def error_class(name: str | None) -> ErrorClass:
    """The row of `name`; an unknown or missing name is `unknown`'s row."""
    return ERROR_CLASSES.get(name or "unknown", ERROR_CLASSES["unknown"])


def glossary_line(spec: ErrorClass) -> str:
    """`spec` in one line for the glossary: what it is; how it is retried; what a retry would do."""
    how = {NOT_RETRIED: "not retried", BACKOFF: "retried with backoff", COOLDOWN: "retried after the provider's "
           "cooldown", AT_ONCE: "retried at once", AT_ONCE_FREE: "retried at once there, using no attempt"}[spec.retried]
    ends = f"; {spec.terminal_event} at once" if not spec.retryable else ""
    return f"{spec.meaning}; {how}{ends} ({spec.on_retry})"


def markdown() -> str:
    """The table the docs carry: `| class | retried | ends the job with | the file's doing | a retry
    ... | permanent | what to do |`, in the table's order."""
    rows = ["| class | what it is | retried | ends the job with | can the file cause it | what a retry would do "
            "| permanent | what to do |", "|---|---|---|---|---|---|---|---|"]
    for c in ERROR_CLASSES.values():
        todo = c.what_to_do.format(job="JOB", letter="JOB/ATTEMPT", still="")
        rows.append(f"| `{c.name}` | {c.meaning} | {RETRIED_WORDS[c.retried]} | {c.ends_with} | "
                    f"{'yes' if c.from_the_file else 'no'} | {c.on_retry} | {'yes' if c.permanent else 'no'} | {todo} |")
    return "\n".join(rows)


def never_permanent_by_history() -> list[str]:
    """The classes whose repeats say nothing about the file (`from_the_file` False), in table order."""
    return [c.name for c in ERROR_CLASSES.values() if not c.from_the_file]
