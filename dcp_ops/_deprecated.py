"""Names and call forms kept for one release (0.2) after they changed, each with a DeprecationWarning that says what to
write instead. Only what an engine could already call is kept; dcp_ops.compat.vllm is not affected."""
import functools
import inspect
import warnings


def keyword_only(fn):
    """fn's keyword-only options may still be passed by position (their old form), in signature order, with a
    DeprecationWarning; a positional option also given by name is a TypeError, as in any Python call."""
    params = inspect.signature(fn).parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    options = [p.name for p in params if p.kind == p.KEYWORD_ONLY]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        extra = args[len(positional):]
        if not extra:
            return fn(*args, **kwargs)
        if len(extra) > len(options):
            raise TypeError(f"{fn.__name__}() takes {len(positional)} positional arguments but {len(args)} were given")
        names = options[:len(extra)]
        for name in names:
            if name in kwargs:
                raise TypeError(f"{fn.__name__}() got multiple values for argument '{name}'")
        warnings.warn(f"{fn.__name__}: passing {', '.join(names)} by position is deprecated and will be refused in "
                      f"dcp_ops 0.3; pass {', '.join(f'{n}=...' for n in names)}", DeprecationWarning, stacklevel=2)
        return fn(*args[:len(positional)], **dict(zip(names, extra)), **kwargs)

    return call


def warn_renamed(old: str, new: str) -> None:
    """The warning of a name kept for one release under its old name (called from the old name's body)."""
    warnings.warn(f"{old} is deprecated and will be removed in dcp_ops 0.3; use {new}", DeprecationWarning,
                  stacklevel=3)
