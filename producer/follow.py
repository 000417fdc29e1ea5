"""What `Client.follow` (producer/client.py) keeps of each job's token stream while it follows it.

A head writes a job's text as entries whose ids say where the text ends (`END-0`, the end marker `END-1`;
workers/head/jobs/job_function.py), and stores the whole result when the job finishes. Token streams can be
written by other clients (a Redis without ACLs, a misconfigured one), so a follower takes an entry only when
it is the head's next one (a text chunk ending where its id says), skips anything else, and once the job
finished checks what it streamed against the stored result: text that ended short of the result's is
completed from it (StreamBroken, repaired, then the rest as the last TextChunk); text that is not the start
of the result's is a StreamBroken, not repaired. Followers never end on a silently truncated text.
"""

from __future__ import annotations

from dataclasses import dataclass

from producer.views import FollowEvent, JobEnded, JobView, StreamBroken, TextChunk, entry_end, token_chunk


@dataclass
class Streamed:
    """One followed job: where its stream was read up to, the text taken from it, and how it stands."""

    index: int  # its position among the jobs followed
    key: str  # its token stream
    last_id: bytes | str = "0-0"
    text: str = ""
    ended: bool = False  # the head's end marker was taken
    settled: bool = False  # its end was yielded (or it ended with no text to check)
    foreign: int = 0  # entries skipped: not the head's next text chunk
    unreadable: str | None = None  # why the stream is read no more (its key holds another type)

    @property
    def reading(self) -> bool:
        return not (self.ended or self.settled or self.unreadable)

    def take(self, job_id: str, entry_id: bytes | str, fields: dict) -> TextChunk | None:
        """The entry as the job's next chunk if it is the head's next (text ending where its id says), else
        None (skipped)."""
        self.last_id = entry_id
        chunk = token_chunk(fields)
        if chunk is None or entry_end(entry_id) != (len(self.text) + len(chunk[0]), int(chunk[1])):
            self.foreign += 1
            return None
        self.text += chunk[0]
        self.ended = chunk[1]
        return TextChunk(job_id, self.index, *chunk)

    def settle(self, view: JobView) -> list[FollowEvent]:
        """A finished job's last events: nothing, or JobEnded if its end marker never came, when what was
        streamed is its result's text (or there is no readable result to check it against); else a
        StreamBroken, with the rest of the text as the last TextChunk when what was streamed is its start."""
        self.settled = True
        text = view.result.get("text") if view.result is not None else None
        if not isinstance(text, str) or text == self.text:
            return [] if self.ended else [JobEnded(view)]
        reason = (view.result or {}).get("stream_broken") or self.why(len(text))
        if text.startswith(self.text) and not self.ended:
            rest = TextChunk(view.job_id, self.index, text[len(self.text) :], True)
            return [StreamBroken(view, str(reason), repaired=True), rest]
        return [StreamBroken(view, str(reason), repaired=False)] + ([] if self.ended else [JobEnded(view)])

    def why(self, total: int) -> str:
        """What the follower saw of a stream that disagrees with the result (the head reported nothing)."""
        if self.unreadable:
            return self.unreadable
        if self.foreign:
            return f"its token stream holds entries that do not continue its text ({self.foreign})"
        return f"its token stream ended after {len(self.text)} of its {total} characters"
