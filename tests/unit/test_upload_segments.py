"""The growing files' segments: their names sort in order, where an upload carries on from what S3
lists, and where the next segment starts in a file that grew, was cut or was replaced."""

import pytest

from segment_sync import Growing, growing_from_listing, part_start, segment_key

EVENTS = "runs/r/tensorboard/events.out.tfevents.1700000000.pod.7.0."
LOG = "runs/r/logs/attempt-0003-pod/"


def test_segment_names_sort_in_their_order_and_after_the_file_name_alone():
    names = [segment_key(EVENTS, n, "") for n in (0, 1, 9, 10, 99, 12345678)]
    assert names == sorted(names)
    assert names[0] == EVENTS + "00000000"
    assert segment_key(LOG, 3, ".log") == LOG + "00000003.log"
    # The next pod's event file (a later second) sorts after every segment of this one.
    assert segment_key(EVENTS, 99999999, "") < "runs/r/tensorboard/events.out.tfevents.1700000001.pod.8.0.00000000"


@pytest.mark.parametrize("listed, size, expected", [
    ([], 0, Growing(0, 0)),
    ([(EVENTS + "00000000", 100), (EVENTS + "00000001", 50)], 200, Growing(150, 2)),
    ([(EVENTS + "00000001", 50), (EVENTS + "00000000", 100)], 150, Growing(150, 2)),  # any listing order
    # another file whose name starts alike is not one of its segments
    ([(EVENTS + "00000000", 100), (EVENTS + "pod1.00000000", 70), (EVENTS + "00000000.partial", 5)], 100,
     Growing(100, 1)),
    # more in S3 than the file holds: replaced; numbering goes on after what is there
    ([(EVENTS + "00000000", 100), (EVENTS + "00000001", 50)], 40, Growing(0, 2)),
])
def test_where_an_upload_carries_on_from_what_s3_lists(listed, size, expected):
    assert growing_from_listing(listed, EVENTS, "", size) == expected


def test_log_segments_are_matched_with_their_suffix():
    listed = [(LOG + "00000000.log", 10), (LOG + "00000001.log", 5), (LOG + "notes.txt", 99), (LOG + "00000002", 1)]
    assert growing_from_listing(listed, LOG, ".log", 15) == Growing(15, 2)


@pytest.mark.parametrize("sent, inode, size, current, start", [
    (0, None, 0, 1, 0),
    (100, None, 150, 1, 100),  # first look in this process: trust what S3 has
    (100, 1, 150, 1, 100),  # grew
    (100, 1, 100, 1, 100),  # unchanged
    (100, 1, 60, 1, 0),  # cut
    (100, 1, 150, 2, 0),  # replaced by another file, even a longer one
])
def test_where_the_next_segment_starts(sent, inode, size, current, start):
    assert part_start(sent, inode, size, current) == start
