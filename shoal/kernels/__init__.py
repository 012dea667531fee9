"""Native compute kernels that torch lacks on some hardware, with torch fallbacks."""
