"""Ready study files, shipped as package data so that ``autotune study`` finds the default one installed."""
