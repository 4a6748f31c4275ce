"""Connection options: credentials files as ``dilu creds`` writes them name their inbox prefix, so
``--creds`` alone is enough; an explicit prefix wins; bad files are one-line errors."""
import nkeys
import pytest

from dilu.services.common.natsconn import CredentialsError, NatsOptions, creds_kwargs, inbox_line


def seed() -> str:
    return nkeys.from_seed(bytearray(b"SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU")).seed.decode()


def write(tmp_path, *lines):
    path = tmp_path / "role.creds"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_creds_file_naming_its_inbox_prefix_connects_with_it(tmp_path):
    path = write(tmp_path, "# dilu role operator", inbox_line("_INBOX_operator"),
                 "-----BEGIN USER NKEY SEED-----", seed(), "------END USER NKEY SEED------")
    assert creds_kwargs(path) == {"nkeys_seed_str": seed(), "inbox_prefix": "_INBOX_operator"}
    kwargs = NatsOptions(creds=path, inbox_prefix=None).connect_kwargs()
    assert kwargs["inbox_prefix"] == "_INBOX_operator"
    assert NatsOptions(creds=path, inbox_prefix="_INBOX_mine").connect_kwargs()["inbox_prefix"] == "_INBOX_mine"


def test_a_bare_seed_has_no_prefix_and_garbage_is_refused(tmp_path):
    assert creds_kwargs(write(tmp_path, seed())) == {"nkeys_seed_str": seed()}
    with pytest.raises(CredentialsError, match="not exactly one user nkey seed"):
        creds_kwargs(write(tmp_path, "nothing here"))
    with pytest.raises(CredentialsError, match="cannot read credentials"):
        creds_kwargs(tmp_path / "missing.creds")


def test_a_jwt_creds_file_goes_to_nats_py_only_when_it_is_whole(tmp_path):
    jwt = "eyJ0eXAiOiJKV1QifQ.eyJzdWIiOiJVQUJDIn0.c2lnbmF0dXJl"  # header.payload.signature, as nsc writes it
    whole = write(tmp_path, "-----BEGIN NATS USER JWT-----", jwt, "------END NATS USER JWT------", "",
                  "-----BEGIN USER NKEY SEED-----", seed(), "------END USER NKEY SEED------")
    assert creds_kwargs(whole) == {"user_credentials": str(whole)}
    # nats-py failed on these with a traceback (nkeys: len() of None) at connect
    for lines in (["-----BEGIN NATS USER JWT-----", "garbage"],
                  ["-----BEGIN NATS USER JWT-----", jwt, "------END NATS USER JWT------"]):  # no seed
        with pytest.raises(CredentialsError, match="not a valid .creds file"):
            creds_kwargs(write(tmp_path, *lines))
