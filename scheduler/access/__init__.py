"""Who may call and how much.

- API keys: what a key looks like and the digest stored of it (``key_format``), the key table and
  its administration (``api_keys``), checking a presented key per request (``key_authenticator``),
  the embedded default's development key (``dev_key``), networks a key may be used from
  (``networks``);
- admission control: rate, queue and tenant limits and revocations (``admission``);
- ``retention``: which retention (purge after finishing) a job gets, and which it may ask for.
"""
