"""Line framing, over-long lines, bodies, JOB_TOO_BIG / EXPECTED_CRLF, pipelining.

Findings from real beanstalkd 1.12 (the protocol document is silent or differs):
- A command line may be 224 bytes including its CRLF. A longer line gets one
  BAD_FORMAT, sent only once the line's CRLF has arrived: the server discards input up
  to the next CRLF and then carries on (the connection stays open). When the 225th byte
  of a line is its LF, the CR was in the discarded part, so the *next* line is the one
  swallowed with the BAD_FORMAT.
- A lone CR that is not followed by LF wedges the line: only the first CR in the buffer is
  looked at, so nothing is answered until 224 bytes have accumulated, which then count
  as an over-long line. A lone LF is just an ordinary byte inside a line.
- JOB_TOO_BIG skips <bytes>+2 bytes of body without checking for the CRLF, and is only
  sent once all of them have arrived (a huge <bytes> swallows the connection's input).
- EXPECTED_CRLF: the body is <bytes>+2 bytes whose last two are not CRLF; the job is
  dropped, but its id is used up (the next job gets the id after it).
"""
from __future__ import annotations

from .harness import case, on_tube, put, replies, send, silent

ALIVE = b"list-tube-used\r\n"


def padded_delete(total: int) -> bytes:
    """A valid `delete <id>` line of exactly `total` bytes including CRLF."""
    head = b"delete "
    return head + b"0" * (total - len(head) - 2 - 10) + b"3000000999\r\n"


CASES = [
    case("line_of_224_bytes_is_fine",
         send("c1", padded_delete(224)),
         send("c1", padded_delete(223)),
         send("c1", ALIVE)),
    case("line_of_225_bytes_swallows_next_line",
         silent("c1", padded_delete(225)),
         send("c1", ALIVE),
         send("c1", ALIVE)),
    case("line_of_300_bytes_then_command_same_packet",
         send("c1", b"x" * 298 + b"\r\n" + ALIVE, n=2),
         send("c1", ALIVE)),
    case("long_put_line",
         send("c1", b"put 0 0 1 1" + b" " * 300 + b"\r\na\r\n" + ALIVE, n=3)),
    case("line_of_448_bytes",
         send("c1", b"y" * 446 + b"\r\n"),
         send("c1", ALIVE)),
    case("line_of_1000_bytes_in_pieces",
         silent("c1", b"z" * 500),
         silent("c1", b"z" * 498),
         send("c1", b"\r\n" + ALIVE, n=2)),
    case("full_buffer_without_crlf_then_crlf",
         silent("c1", b"x" * 224),
         send("c1", b"\r\n" + ALIVE, n=2)),
    case("full_buffer_ending_in_cr",
         silent("c1", b"x" * 223 + b"\r"),
         send("c1", b"\n" + ALIVE),
         send("c1", ALIVE)),
    case("long_line_cr_and_lf_in_separate_packets",
         silent("c1", b"x" * 300 + b"\r"),
         send("c1", b"\n" + ALIVE, n=2)),
    case("long_tube_name_line",
         send("c1", b"use " + b"a" * 218 + b"\r\n"),
         send("c1", b"watch " + b"a" * 300 + b"\r\n"),
         send("c1", ALIVE)),
    case("lone_cr_wedges_until_buffer_full",
         silent("c1", b"list-tube-used\rX\r\n"),
         silent("c1", ALIVE),
         send("c1", ALIVE * 12 + b"list-tube-used\r\n", n=2),
         send("c1", ALIVE)),
    case("leading_cr_wedges",
         silent("c1", b"\r" + ALIVE),
         silent("c1", b"\r\r\n")),
    case("lone_lf_is_part_of_line",
         send("c1", b"list-tube-used\nlist-tube-used\r\n"),
         send("c1", b"\n" + ALIVE),
         send("c1", ALIVE)),
    case("lf_then_crlf_line",
         send("c1", b"\n\r\n"),
         send("c1", ALIVE)),
    case("command_split_across_packets",
         silent("c1", b"list-tu"),
         silent("c1", b"be-used\r"),
         send("c1", b"\n")),
    case("put_line_and_body_in_separate_packets",
         on_tube(),
         silent("c1", b"put 0 0 60 5\r\n"),
         silent("c1", b"he"),
         silent("c1", b"llo\r"),
         send("c1", b"\n"),
         send("c1", b"reserve-with-timeout 0\r\n")),
    case("body_containing_command_text",
         on_tube(),
         send("c1", b"put 0 0 60 16\r\nlist-tube-used\r\n\r\n" + ALIVE, n=2),
         send("c1", b"reserve-with-timeout 0\r\n")),
    case("pipelined_many_commands_one_packet",
         on_tube(),
         send("c1", b"".join(put(b"job-%03d" % i, pri=i % 3) for i in range(50))
              + b"reserve-with-timeout 0\r\n" * 50 + b"stats-tube {t}\r\n" + ALIVE, n=102),
         send("c1", b"".join(b"delete {j%d}\r\n" % i for i in range(1, 51)), n=50),
         send("c1", b"stats-tube {t}\r\n")),
    case("pipelined_mixed_with_errors",
         on_tube(),
         send("c1", b"bogus\r\n" + put(b"a") + b"delete x\r\n" + b"peek-ready\r\n" + b"\r\n"
              + b"reserve-with-timeout 0\r\n" + b"use -bad\r\n" + ALIVE, n=8)),
    case("pipelined_byte_by_byte",
         on_tube(),
         *[silent("c1", bytes([b]), window=0.02) for b in b"put 0 0 60 2\r\nhi\r"],
         send("c1", b"\n"),
         send("c1", b"peek-ready\r\n")),
    case("expected_crlf_wrong_trailer",
         on_tube(),
         send("c1", b"put 0 0 10 1\r\nab\r\n"),
         send("c1", ALIVE),
         send("c1", b"peek-ready\r\n")),
    case("expected_crlf_body_too_long",
         on_tube(),
         send("c1", b"put 0 0 10 2\r\nabcd"),
         send("c1", ALIVE)),
    case("expected_crlf_swapped_crlf",
         on_tube(),
         send("c1", b"put 0 0 10 2\r\nab\n\r"),
         send("c1", ALIVE)),
    case("expected_crlf_body_short_eats_next_command",
         on_tube(),
         send("c1", b"put 0 0 10 6\r\nab\r\n" + ALIVE, n=2),
         send("c1", ALIVE)),
    case("expected_crlf_uses_up_a_job_id",
         send("c1", put(b"first")),
         send("c1", b"put 0 0 10 1\r\nab\r\n"),
         send("c1", b"\r\n"),
         send("c1", put(b"second")),
         send("c1", b"stats-job 2\r\nstats-job 3\r\n", n=2),
         fresh=True),
    case("job_too_big_default_limit",
         on_tube(),
         send("c1", b"put 0 0 60 65536\r\n" + b"b" * 65536 + b"\r\n" + ALIVE, n=2),
         send("c1", b"peek-ready\r\n")),
    case("job_too_big_with_z",
         send("c1", b"put 0 0 1 11\r\n01234567890\r\n" + ALIVE, n=2),
         send("c1", put(b"0123456789")),
         send("c1", b"put 0 0 1 0\r\n\r\n"),
         send("c1", b"stats\r\n"),
         args=["-z", "10"]),
    case("job_too_big_body_in_pieces",
         silent("c1", b"put 0 0 1 11\r\n0123"),
         send("c1", b"4567890\r\n" + ALIVE, n=2),
         args=["-z", "10"]),
    case("job_too_big_skips_without_checking_crlf",
         send("c1", b"put 0 0 1 11\r\n01234567890xx" + ALIVE, n=2),
         args=["-z", "10"]),
    case("job_too_big_huge_declared_size_swallows_rest",
         silent("c1", b"put 0 0 1 4294967295\r\n"),
         silent("c1", ALIVE * 3),
         silent("c1", b"quit\r\n"),
         args=["-z", "10"]),
    case("job_too_big_z_zero",
         send("c1", b"put 0 0 1 1\r\na\r\n"),
         send("c1", b"put 0 0 1 0\r\n\r\n"),
         send("c1", b"stats-job 1\r\n"),
         args=["-z", "0"]),
    case("put_bytes_over_u32_is_bad_format",
         send("c1", b"put 0 0 1 4294967296\r\n"),
         send("c1", ALIVE)),
    case("reply_order_with_blocked_reserve_in_pipeline",
         on_tube(),
         silent("c1", b"reserve\r\n" + ALIVE + b"stats-tube {t}\r\n"),
         send("c2", b"use {t}\r\n" + put(b"wake"), n=2),
         replies("c1", 3)),
]
