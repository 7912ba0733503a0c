"""Malformed commands: BAD_FORMAT / UNKNOWN_COMMAND and friends, and whether the
connection survives each error (every case ends with a command that must still work).

Findings from real beanstalkd 1.12 that the protocol document does not say:
- A command is recognised by prefix *including* its separating space where it has
  arguments: "put" / "delete" / "kick" / "use" / "peek" / "touch" alone (no space) are
  UNKNOWN_COMMAND, but "stats-job" alone is BAD_FORMAT (it matches the "stats" prefix,
  then fails the no-trailing-text check), and "reservex" / "statsx" are BAD_FORMAT.
- "quit" is matched by prefix: "quitx" and "quit now" close the connection.
- Numbers may be preceded by any number of spaces ("delete   5" works); a trailing
  space after the last number is BAD_FORMAT for put/delete/..., but "kick 1 " works.
- reserve-with-timeout parses its number loosely (like strtol): "abc" means 0 (TIMED_OUT
  at once), "1x" and "+1" mean 1, "-1" blocks like reserve, a trailing space is
  accepted; only an out-of-range number is BAD_FORMAT.
- kick parses loosely too: "kick -1" and "kick 4294967296" are KICKED, not BAD_FORMAT.
- A NUL byte anywhere in a command line makes it BAD_FORMAT (even "\0\r\n", which is
  not UNKNOWN_COMMAND).
- After a BAD_FORMAT put, the body is NOT skipped: it is read as the next command.
"""
from __future__ import annotations

from .harness import case, closed, on_tube, put, replies, send, silent

ALIVE = b"list-tube-used\r\n"


def err(name: str, data: bytes, n: int = 1, setup: bool = False):
    """One malformed exchange, then proof the connection is still usable."""
    steps = [on_tube()] if setup else []
    steps += [send("c1", data, n=n), send("c1", ALIVE)]
    return case("err_" + name, *steps)


CASES = [
    # -- put -------------------------------------------------------------------------
    err("put_no_args", b"put\r\n"),
    err("put_space_only", b"put \r\n"),
    err("put_one_arg", b"put 1\r\n"),
    err("put_three_args", b"put 1 2 3\r\n"),
    err("put_five_args_body_read_as_command", b"put 1 2 3 4 5\r\nabcd\r\n", n=2),
    err("put_trailing_space", b"put 0 0 1 1 \r\na\r\n", n=2),
    err("put_leading_plus", b"put +1 0 1 1\r\na\r\n", n=2),
    err("put_negative_pri", b"put -1 0 1 1\r\na\r\n", n=2),
    err("put_negative_delay", b"put 0 -1 1 1\r\na\r\n", n=2),
    err("put_negative_ttr", b"put 0 0 -1 1\r\na\r\n", n=2),
    err("put_negative_bytes", b"put 0 0 1 -1\r\na\r\n", n=2),
    err("put_pri_over_u32", b"put 4294967296 0 1 1\r\na\r\n", n=2, setup=True),
    err("put_delay_over_u32", b"put 0 4294967296 1 1\r\na\r\n", n=2, setup=True),
    err("put_ttr_over_u32", b"put 0 0 4294967296 1\r\na\r\n", n=2, setup=True),
    err("put_huge_number", b"put 99999999999999999999999 0 1 1\r\na\r\n", n=2, setup=True),
    err("put_trailing_garbage_on_bytes", b"put 0 0 1 1x\r\na\r\n", n=2),
    err("put_letters", b"put a b c d\r\n"),
    err("put_hex", b"put 0x1 0 1 1\r\na\r\n", n=2),
    err("put_tab_separated", b"put\t0\t0\t1\t1\r\na\r\n", n=2),
    err("put_uppercase", b"PUT 0 0 1 1\r\na\r\n", n=2),
    # -- single-id commands ------------------------------------------------------------
    err("delete_no_arg", b"delete\r\n"),
    err("delete_space_only", b"delete \r\n"),
    err("delete_trailing_garbage", b"delete 1x\r\n"),
    err("delete_trailing_space", b"delete 3000000999 \r\n"),
    err("delete_negative", b"delete -1\r\n"),
    err("delete_plus", b"delete +1\r\n"),
    err("delete_two_args", b"delete 1 2\r\n"),
    err("delete_id_max_u64", b"delete 18446744073709551615\r\n"),
    err("delete_id_over_u64", b"delete 18446744073709551616\r\n"),
    err("delete_id_zero", b"delete 0\r\n"),
    err("peek_no_arg", b"peek\r\n"),
    err("peek_space_only", b"peek \r\n"),
    err("peek_garbage", b"peek abc\r\n"),
    err("peek_negative", b"peek -5\r\n"),
    err("peek_id_zero", b"peek 0\r\n"),
    err("touch_no_arg", b"touch\r\n"),
    err("touch_garbage", b"touch x\r\n"),
    err("kick_job_no_arg", b"kick-job\r\n"),
    err("kick_job_garbage", b"kick-job 1z\r\n"),
    err("stats_job_no_arg", b"stats-job\r\n"),
    err("stats_job_space_only", b"stats-job \r\n"),
    err("stats_job_garbage", b"stats-job one\r\n"),
    err("reserve_job_no_arg", b"reserve-job\r\n"),
    err("reserve_job_negative", b"reserve-job -1\r\n"),
    err("reserve_job_trailing", b"reserve-job 3000000999 x\r\n"),
    # -- release / bury / kick ----------------------------------------------------------
    err("release_missing_delay", b"release 3000000999 1\r\n"),
    err("release_missing_all", b"release\r\n"),
    err("release_negative_delay", b"release 3000000999 1 -1\r\n"),
    err("release_pri_over_u32", b"release 3000000999 4294967296 0\r\n"),
    err("bury_missing_pri", b"bury 3000000999\r\n"),
    err("bury_negative_pri", b"bury 3000000999 -1\r\n"),
    err("bury_no_args", b"bury\r\n"),
    err("kick_no_arg", b"kick\r\n"),
    err("kick_space_only", b"kick \r\n"),
    err("kick_negative", b"kick -1\r\n"),
    err("kick_garbage", b"kick ten\r\n"),
    err("kick_over_u32", b"kick 4294967296\r\n"),
    err("kick_trailing_space", b"kick 1 \r\n", setup=True),
    # -- reserve --------------------------------------------------------------------------
    err("reserve_trailing_space", b"reserve \r\n"),
    err("reserve_trailing_text", b"reservex\r\n"),
    err("reserve_with_timeout_no_arg", b"reserve-with-timeout\r\n"),
    err("reserve_with_timeout_letters_means_zero", b"reserve-with-timeout abc\r\n", setup=True),
    err("reserve_with_timeout_trailing_space", b"reserve-with-timeout 0 \r\n", setup=True),
    err("reserve_with_timeout_double_space", b"reserve-with-timeout  0\r\n", setup=True),
    err("reserve_with_timeout_huge", b"reserve-with-timeout 99999999999999999999\r\n", setup=True),
    case("err_reserve_with_timeout_negative_blocks",
         on_tube(), silent("c1", b"reserve-with-timeout -1\r\n"),
         send("c2", b"use {t}\r\n" + put(b"x"), n=2),
         replies("c1", 1),
         send("c1", ALIVE)),
    # -- tube names -----------------------------------------------------------------------
    err("use_no_arg", b"use\r\n"),
    err("use_space_only", b"use \r\n"),
    err("use_two_spaces", b"use  {t}\r\n"),
    err("use_trailing_space", b"use {t} \r\n"),
    err("use_leading_hyphen", b"use -{t}\r\n"),
    err("use_bad_char_star", b"use {t}*\r\n"),
    err("use_bad_char_at", b"use {t}@x\r\n"),
    err("use_bad_char_colon", b"use {t}:x\r\n"),
    err("use_bad_char_high_byte", b"use {t}\xe9\r\n"),
    err("use_two_names", b"use {t} {t}\r\n"),
    err("use_201_chars", b"use " + b"n" * 201 + b"\r\n"),
    err("use_nul_inside", b"use {t}\x00x\r\n"),
    err("watch_no_arg", b"watch\r\n"),
    err("watch_leading_hyphen", b"watch -x\r\n"),
    err("watch_201_chars", b"watch " + b"w" * 201 + b"\r\n"),
    err("watch_bad_char", b"watch a!b\r\n"),
    err("ignore_no_arg", b"ignore\r\n"),
    err("ignore_bad_char", b"ignore a b\r\n"),
    err("ignore_201_chars", b"ignore " + b"i" * 201 + b"\r\n"),
    err("stats_tube_no_arg", b"stats-tube\r\n"),
    err("stats_tube_bad_name", b"stats-tube -x\r\n"),
    err("stats_tube_201_chars", b"stats-tube " + b"s" * 201 + b"\r\n"),
    err("pause_tube_no_args", b"pause-tube\r\n"),
    err("pause_tube_missing_delay", b"pause-tube {t}\r\n"),
    err("pause_tube_negative_delay", b"pause-tube {t} -1\r\n", setup=True),
    err("pause_tube_bad_name", b"pause-tube -x 1\r\n"),
    err("pause_tube_delay_over_u32", b"pause-tube {t} 4294967296\r\n", setup=True),
    err("pause_tube_trailing_garbage", b"pause-tube {t} 1x\r\n", setup=True),
    # -- no-argument commands with extra text ---------------------------------------------
    err("stats_trailing_space", b"stats \r\n"),
    err("stats_trailing_text", b"statsx\r\n"),
    err("list_tubes_trailing", b"list-tubes \r\n"),
    err("list_tubes_text", b"list-tubesx\r\n"),
    err("list_tube_used_trailing", b"list-tube-used x\r\n"),
    err("list_tubes_watched_trailing", b"list-tubes-watched \r\n"),
    err("peek_ready_trailing", b"peek-ready \r\n"),
    err("peek_delayed_trailing", b"peek-delayed x\r\n"),
    err("peek_buried_trailing", b"peek-buried 1\r\n"),
    # -- unknown --------------------------------------------------------------------------
    err("unknown_word", b"frobnicate\r\n"),
    err("unknown_empty_line", b"\r\n"),
    err("unknown_three_empty_lines", b"\r\n\r\n\r\n", n=3),
    err("unknown_leading_space", b" list-tube-used\r\n"),
    err("unknown_uppercase", b"STATS\r\n"),
    err("nul_line_is_bad_format", b"\x00\r\n"),
    err("binary_line_with_nul", b"\xff\xfe\x00\x01\r\n"),
    err("nul_after_command", b"list-tube-used\x00junk\r\n"),
    err("tab_separator", b"delete\t1\r\n"),
    err("lf_inside_line", b"list-tube-used\nlist-tube-used\r\n"),
    # -- near-miss command names (prefix matching) ----------------------------------------
    err("near_stats_tubes", b"stats-tubes default\r\n"),
    err("near_stats_jobs", b"stats-jobs 1\r\n"),
    err("near_reserve_jobs", b"reserve-jobs 1\r\n"),
    err("near_reserve_with_timeouts", b"reserve-with-timeouts 0\r\n"),
    err("near_kick_jobs", b"kick-jobs 1\r\n"),
    err("near_kickjob", b"kickjob 1\r\n"),
    err("near_touchy", b"touchy 1\r\n"),
    err("near_used", b"used foo\r\n"),
    err("near_watching", b"watching foo\r\n"),
    err("near_ignored", b"ignored foo\r\n"),
    err("near_pause_tubes", b"pause-tubes foo 1\r\n"),
    err("near_peeks", b"peeks 1\r\n"),
    err("near_peek_readyish", b"peek-ready-now\r\n"),
    err("near_list_tube", b"list-tube\r\n"),
    err("near_list", b"list\r\n"),
    err("near_deleted", b"deleted 1\r\n"),
    err("near_buryx", b"buryx 1 1\r\n"),
    err("near_releases", b"releases 1 1 1\r\n"),
    err("near_puts", b"puts 0 0 1 1\r\n"),
    err("near_reserve_tab", b"reserve\t\r\n"),
    err("quit_with_nul_is_bad_format_not_quit", b"quit\x00\r\n"),
    case("err_quitting_closes", closed("c1", b"quitting\r\n")),
]
