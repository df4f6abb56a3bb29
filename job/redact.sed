# Hides the userinfo of every URL (scheme://user:password@host -> scheme://***@host): index URLs
# with tokens in requirements.txt, endpoints with keys. Used by script.sh's log pipeline (all the
# pod prints, and the log it uploads) and by python_env.sh. Run as: LC_ALL=C sed -E -f redact.sed
# The userinfo runs to the last @ before the path: a password with a raw @ is hidden whole.
s#([A-Za-z][A-Za-z0-9+.-]*://)[^/[:space:]"'<>]*@#\1***@#g
