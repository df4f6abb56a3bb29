# Hides credentials in URLs: every URL's userinfo (scheme://user:password@host -> scheme://***@host)
# and the value of every query parameter whose name looks secret (?private_token=...,
# &X-Amz-Signature=..., api_key, client_secret, sig, password, auth, credential: the name holds one
# of token, key, secret, sig, pass, pwd, cred, auth, any case, or starts with X-Amz-) -> name=***.
# Index URLs with tokens in requirements.txt, endpoints with keys, presigned URLs. Used by
# script.sh's log pipeline (all the pod prints, and the log it uploads) and by python_env.sh. Run
# as: LC_ALL=C sed -E -f redact.sed
# The userinfo runs to the last @ before the path: a password with a raw @ is hidden whole.
s#([A-Za-z][A-Za-z0-9+.-]*://)[^/[:space:]"'<>]*@#\1***@#g
s#([?&;][^=&;#[:space:]"'<>]*([Tt][Oo][Kk][Ee][Nn]|[Kk][Ee][Yy]|[Ss][Ee][Cc][Rr][Ee][Tt]|[Ss][Ii][Gg]|[Pp][Aa][Ss][Ss]|[Pp][Ww][Dd]|[Cc][Rr][Ee][Dd]|[Aa][Uu][Tt][Hh])[^=&;#[:space:]"'<>]*=)[^&;#[:space:]"'<>]+#\1***#g
s#([?&;][Xx]-[Aa][Mm][Zz]-[^=&;#[:space:]"'<>]*=)[^&;#[:space:]"'<>]+#\1***#g
