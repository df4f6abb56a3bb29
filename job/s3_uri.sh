# shellcheck shell=bash
# The shell's one rule for an s3://bucket/prefix/ URI (job/contract.py's S3_URI_RULE is Python's):
# "s3://", a bucket name S3 accepts, then an optional /prefix. Sourced by settings.sh from beside it
# (the ConfigMap mounts job/ flat), and by scripts/stage.sh and scripts/tensorboard.sh from job/.
#
#   fault=$(s3_uri_fault "${uri}") || die 64 "${uri} ${fault}; fix it in job.yaml"

# Prints why $1 is not an s3://bucket/prefix/ URI and returns 1; prints nothing when it is one.
# A prefix may hold any character S3 keys may (status and TensorBoard look at hostile runs too); the
# pod refuses control characters in every setting before this (settings.sh), and callers show the
# URI with them as "?".
s3_uri_fault() {
  [[ "$1" =~ ^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$ ]] && return 0
  printf 'is not an s3://bucket/prefix/ URI'
  [[ "$1" != s3://* ]] || printf ' (a bucket name: 3 to 63 lowercase letters, digits, dots and hyphens)'
  return 1
}
