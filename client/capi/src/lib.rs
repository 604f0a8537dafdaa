//! `librfaas`: the C API of the rfaas client library.
