"""The kiln build pipeline run by a build Job (`kiln build`)."""
