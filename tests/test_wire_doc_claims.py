"""Claims of docs/wire-format.md that a client in another language copies as they are (a script's text,
a digest, a list of names, a number), checked against the code they describe. No Redis, no worker."""

from __future__ import annotations

import json
import re
from typing import Any

from ortq import keys, redisfunctions, wire
from ortq.control import MAX_WORKERS
from ortq.producer import enqueue, replybook, responses, waiting
from ortq.producer.enqueue import JobOptions
from ortq.settings import Settings
from ortq.signature import ModelSignature, TensorSpec
from tests.conftest import REPO

PAGE = (REPO / "docs" / "wire-format.md").read_text()
SECURITY = (REPO / "docs" / "security.md").read_text()


def section(start: str, end: str) -> str:
    return PAGE[PAGE.index(start) : PAGE.index(end)]


def producer_rule() -> list[str]:
    found = re.search(r"^user ortq-producer on #<sha256 of its password> (.*)$", SECURITY, re.M)
    assert found is not None, "docs/security.md gives no producer rule"
    return found.group(1).split()


def test_the_unique_enqueue_fallback_script_is_the_one_ortq_sends() -> None:
    """Section 3.6 gives the EVAL fallback of the unique enqueue whole, as 3.5 does its script."""
    found = re.search(r"```lua\n(.*?)```", section("### 3.6", "### 3.7"), re.S)
    assert found is not None, "section 3.6 gives no script"
    assert found.group(1) == redisfunctions.unique_script_source()


def test_the_signature_records_example_digest_is_its_digest() -> None:
    """Section 5's example record: its ``digest`` is what workers and ortq's producer compute from it."""
    found = re.search(r"```json\n(\{\"model\".*?)```", section("## 5.", "### 5.1"), re.S)
    assert found is not None
    record = json.loads(found.group(1))
    assert ModelSignature.from_json(record).digest == record["digest"]
    assert f"has digest `{record['digest']}`" in PAGE


def test_the_non_ascii_digest_example() -> None:
    """The escaped JSON the page shows is the text the digest hashes, and its digest the one named."""
    signature = ModelSignature(
        (TensorSpec("bild_\u00e9", "float32", ("N", None, 3)),), (TensorSpec("y", "float32", (1,)),)
    )
    covered = {
        "inputs": [s.digest_json() for s in signature.inputs],
        "outputs": [s.digest_json() for s in signature.outputs],
    }
    text = json.dumps(covered, separators=(",", ":"))
    assert f"```\n{text}\n```" in PAGE
    assert f"hashes this text, digest `{signature.digest}`" in PAGE


def test_the_escapes_the_page_names_are_pythons() -> None:
    assert json.dumps("\u007f\u00e9\U0001f600/\b") == '"\\u007f\\u00e9\\ud83d\\ude00/\\b"'
    assert "`\\ud83d\\ude00`" in PAGE


def test_the_errors_taken_without_a_proof() -> None:
    """4.3's list of the errors a producer takes without a proof is the producer's."""
    found = re.search(r"`error.type` is one of (.*?): it is the answer too", section("### 4.3", "### 4.4"), re.S)
    assert found is not None
    assert set(re.findall(r"`(\w+)`", found.group(1))) == responses.UNPROVEN_ERRORS


def test_retry_intervals_as_ortq_writes_them() -> None:
    options = JobOptions(request_ttl=60, result_ttl=60, failure_ttl=60, retries=3, retry_backoff=1)
    written = enqueue.job_hash("digits", options, "2024-05-01T12:00:00.000000Z")["retry_intervals"]
    assert written == "[1, 2, 4]"
    row = next(line for line in PAGE.splitlines() if line.startswith("| `retry_intervals`"))
    assert f"`{written}`" in row and '`", "` between values' in row


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, args))


def test_the_canceled_score_is_whole_seconds() -> None:
    """3.4: the cancel's ZADD score is whole epoch seconds."""
    pipe = _Recorder()
    enqueue.add_cancel(pipe, "job-1", "digits")
    [(_, (_, mapping))] = [call for call in pipe.calls if call[0] == "zadd"]
    assert type(mapping["job-1"]) is int
    assert "is whole seconds: ortq writes `int(time)`" in PAGE


def test_the_non_blocking_reads_are_ones_the_producer_rule_grants() -> None:
    """4.1 reads a large answer and looks an answer up with XREAD without BLOCK, and the job hash
    with HGET, which the producer rule grants; not XRANGE or HMGET, which it does not."""
    rule = producer_rule()
    assert {"+xread", "+hget"} <= set(rule) and not {"+xrange", "+hmget"} & set(rule)
    text = " ".join(section("### 4.1", "### 4.2").split())
    assert "`XREAD COUNT 1 STREAMS ortq:reply:<model>:<id> 0-0`" in text
    assert "XREAD COUNT 1 STREAMS ortq:reply:<model>:<ortq_reply> <the id just below ortq_answer>" in text
    assert "`HGET rq:job:<id> ortq_reply` and `HGET rq:job:<id> ortq_answer`" in text


def test_the_reply_name_as_ortq_makes_and_reads_it() -> None:
    """Section 1's rule for a reply name is keys.reply_keep's, and ortq's names follow it."""
    found = re.search(r"The whole name matches\s+`([^`]+)`", section("## 1.", "## 2."))
    assert found is not None
    rule = re.compile(found.group(1))
    for name in [keys.new_reply_name(600), "a.1", "A_b-9." + "9" * 8, "x" * 64 + ".31536000"]:
        assert rule.fullmatch(name) and keys.reply_keep(name) is not None, name
    for name in ["a", "a.0", "a.01", ".5", "a.b.5", "x" * 65 + ".5", "a.123456789", "a b.5"]:
        assert not rule.fullmatch(name) and keys.reply_keep(name) is None, name
    assert keys.reply_keep("a.99999999") == keys.MAX_REPLY_KEEP == 31_536_000
    assert "from 1 to 31,536,000" in PAGE
    assert "ortq_reply <reply name>" in section("### 3.2", "### 3.3")
    options = JobOptions(request_ttl=60, result_ttl=60, failure_ttl=60, reply="t.60")
    assert enqueue.job_hash("digits", options, "2024-05-01T12:00:00.000000Z")["ortq_reply"] == "t.60"


def test_the_wait_as_section_4_1_gives_it() -> None:
    """4.1's XREAD count, the id just below an answer's entry, and how often a job is looked up."""
    text = " ".join(section("### 4.1", "### 4.2").split())
    assert f"XREAD BLOCK <milliseconds> COUNT {replybook.READ_COUNT} STREAMS" in text
    assert replybook.entry_before("5-3") == "5-2" and replybook.entry_before("5-0") == "4-18446744073709551615"
    assert "or `<ms - 1>-18446744073709551615` when `<seq>` is 0" in text
    assert waiting.LOOK_AGAIN == (0.01, 0.5) and "ortq looks after 10 ms, doubling up to 0.5 s" in text


def test_the_models_of_unknown_model_are_read_with_granted_commands() -> None:
    """3.1: the live workers' models are found with SRANDMEMBER and MGET, granted; not KEYS or SCAN."""
    rule = producer_rule()
    assert {"+srandmember", "+mget"} <= set(rule) and not {"+scan", "+keys"} & set(rule)
    assert re.search(rf"`SRANDMEMBER ortq:workers\s+{MAX_WORKERS}`", PAGE)
    assert "+client|setinfo" not in rule  # security.md, "Newer Redis": no rule grants it


def test_the_missing_function_errors_ortq_recognises() -> None:
    """3.5: a reply holding "function not found" or "unknown command", in any case, is the missing function."""
    for text in (
        "ERR Function not found",
        "ERR unknown command 'FCALL', with args beginning with: ",
        "ERR Unknown command",
    ):
        assert enqueue.is_missing_function(Exception(text))
    assert not enqueue.is_missing_function(Exception("WRONGTYPE Operation against a key holding the wrong kind"))
    assert "`function not found` or `unknown command`" in PAGE


def test_the_default_command_timeout() -> None:
    assert Settings().socket_timeout == 10.0
    assert "(`Settings.socket_timeout`, 10 s by default)" in PAGE


def test_served_by_of_worker_lost_and_of_an_unproven_error_after_the_check() -> None:
    """6.2 and 4.3: a WorkerLost (written by the recovery, not after a check) names no version; an
    unproven error made after the check does."""
    lost = wire.decode_response(wire.encode_error("WorkerLost", "gone"))
    assert lost.version is None and lost.proof is None
    served = wire.Served("v1", "0123456789abcdef")
    expired = wire.decode_response(wire.encode_error("RequestExpired", "gone", None, None, served))
    assert (expired.version, expired.signature, expired.proof) == ("v1", "0123456789abcdef", None)
