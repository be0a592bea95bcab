"""The exceptions of tensormp: every failure is an Error."""


class Error(Exception):
    """A tensormp call failed; the message says what failed on what."""


class Timeout(Error, TimeoutError):
    """The timeout passed first: nothing was sent or taken."""


class Closed(Error, EOFError):
    """The queue, pipe or listener, or the process at its other end, is closed."""


class InvalidValue(Error, TypeError, ValueError):
    """A value tensormp cannot send or view: a type it does not carry, a
    dict key that is not a string, a tensor with no view of that kind.

    It also stands for a value received that is not well formed: a
    message from the peer that the library refused (it is dropped, what
    it brought is closed, and the pipe or queue goes on), or a value from
    the library that this package cannot decode."""
