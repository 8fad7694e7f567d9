"""The one exception users see: a sentence naming the problem and what to do."""


class MoECompressError(Exception):
    """Bad input or an unsupported situation. The CLI prints the message alone and exits 2."""

    exit_code = 2
