"""Which mounts the local pod runner makes read-only under readOnlyRootFilesystem, and how it reads
mount points from /proc/self/mountinfo."""

import pytest

import local_pod

POINTS = ["/", "/proc", "/proc/sys/fs/binfmt_misc", "/sys", "/sys/fs/cgroup", "/dev", "/dev/shm", "/dev/pts",
          "/usr", "/work", "/tmp", "/home/eai_role", "/opt/job", "/etc/hosts", "/etc/passwd", "/devices"]


@pytest.mark.parametrize("volumes, expected", [
    # No volumes: every mount of the "image" goes read-only, /tmp too (it is part of a real rootfs).
    (set(), ["/", "/sys", "/sys/fs/cgroup", "/usr", "/work", "/tmp", "/home/eai_role", "/opt/job",
             "/etc/passwd", "/devices"]),
    # Writable volumes stay writable; a name that only starts like /dev is not under /dev.
    ({"/tmp", "/home/eai_role"}, ["/", "/sys", "/sys/fs/cgroup", "/usr", "/work", "/opt/job", "/etc/passwd",
                                  "/devices"]),
])
def test_read_only_root_targets(volumes, expected):
    assert local_pod.read_only_root_targets(POINTS, volumes) == expected


@pytest.mark.parametrize("field, path", [
    ("/", "/"),
    (r"/mnt/with\040space", "/mnt/with space"),
    (r"/a\011tab\012newline\134backslash", "/a\ttab\nnewline\\backslash"),
])
def test_unescape_mount_point(field, path):
    assert local_pod.unescape_mount_point(field) == path
