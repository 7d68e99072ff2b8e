"""Model families (one package per family); the registry is owned by issue 11."""
