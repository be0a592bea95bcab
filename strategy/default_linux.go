package strategy

// platformDefault is file_descriptor where descriptors can be passed and
// segments unlinked at once.
const platformDefault = FileDescriptor
